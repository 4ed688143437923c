"""Hopper decode: 64x256x64 tiles, two warpgroups side by side along N, split-K 4.

At M <= 64 the work is streaming the NVFP4 weight. N = 8192 gives only 32 tiles of 256
columns for 132 SMs; splitting K four ways gives 128 work units so (nearly) every SM reads
its own slice of the weight. FP32 partials are reduced on the host side in a fixed order.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(64, 256, 64), warps=Warps(mma=(1, 2)),
                    split_k=4)
