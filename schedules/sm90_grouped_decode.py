"""Hopper MoE experts (W4A16) at decode: grouped rs_packed with 16-token tiles.

At decode an expert gets a few tokens (16 tokens x top-8 over 128 experts: about one each),
so the work is streaming every routed expert's weight once. A 16-row token tile (WGMMA
N = 16) keeps the MMA work per weight byte small and the stages small: 128 weight rows x
128 K per stage (8 KiB of packed weight plus scales), 17 stages in flight per SM. Units are
(expert, token tile, 128 weight rows); consecutive units are an expert's weight tiles.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(16, 128, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
