"""Hopper W4A16 decode (M <= 16): packed-weight register-sourced mainloop, 16 activation
rows x 256 weight rows over four consumer warpgroups.

At decode the kernel streams the weight and decoding it in registers (E2M1 x UE4M3 table
lookups) is what limits an SM, so four consumer warpgroups of 64 weight rows (16 warps)
keep twice the decode chains in flight of sm90_rs_packed_m64's two; the 16-row activation
tile (WGMMA N = 16) keeps the accumulators at 8 registers. "auto" adds split-K so that the
grid fills the SMs (32 weight tiles at N = 8192). Measured on grouped expert GEMMs first
(schedules/sm90_grouped_decode.py, 2026-12-01): 1.1x the two-warpgroup 16x128 tile.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(16, 256, 128), warps=Warps(mma=(4, 1)),
                    mainloop="rs_packed")
