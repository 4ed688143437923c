"""Pingpong: two groups of 4 MMA warps work on alternating output tiles.

While one group runs its epilogue the other keeps the tensor cores busy, hiding the
store. Each group owns a whole 128x128 tile with a 2x2 warp layout, so each thread holds
twice the accumulators of the cooperative schedule (more registers, no more smem).
"""

from cute_fp4.schedule import Schedule, Tile, WarpRoles, Warps

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128),
                    warps=Warps(roles=WarpRoles.PINGPONG, mma=(2, 2)))
