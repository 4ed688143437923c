"""Hopper W4A16, mid M: the packed-weight register-sourced mainloop with 256 weight rows.

Same mainloop as sm90_rs_packed, but each consumer warpgroup owns 128 weight rows (two
64-row WGMMA M blocks sharing every activation K block) and the activation tile is 128 rows
(WGMMA N = 128): tiles twice as tall along the weight, so each activation tile is read
from L2 half as often, and K 128 per stage (two 16-byte fragment loads per M block) halves
the barrier waits per K. The price: twice the decode per activation column (96 K-loop
instructions per 64x256x16 of MMA work against 55 for sm90_rs_packed on sm_90a). A
candidate for mid M (128 < M <= 1024) to be measured; the heuristic does not pick it.
Four ~50 KB stages; D^T stored from registers.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 256, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed")
