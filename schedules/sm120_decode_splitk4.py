"""Decode with split-K 4: 64x128x128 tiles, each output tile's K range split over 4 CTAs.

With M = 1 and N = 8192 there are only 64 output tiles of 128 columns, a third of the
RTX PRO 6000's 188 SMs. Splitting K four ways gives 256 work units so every SM streams
the weight; the FP32 partials are reduced in a fixed order (deterministic).
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_120a", tile=Tile(64, 128, 128), warps=Warps(mma=(2, 4)),
                    split_k=4)
