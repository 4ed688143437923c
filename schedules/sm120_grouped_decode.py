"""SM120 MoE experts (W4A4) at decode: 32-row token tiles, 2 x 4 MMA warps.

With a few tokens per expert the kernel streams the routed experts' weights; a 32-row
tile computes little past the expert's tokens, and without a C buffer eight 128x128 stages
of weight fit in 99 KiB (one 128-row atom of A's scales is still staged per stage).
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_120a", tile=Tile(32, 128, 128), warps=Warps(mma=(2, 4)),
                    scheduler=Scheduler(grouped=True))
