"""Hopper 128x128x64: half the N of the default, twice the CTAs, 14 stages.

For mid-size problems where 128x256 tiles leave SMs idle (fewer than 132 tiles), and as
the variant with the most load stages in flight.
"""

from cute_fp4.schedule import Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 128, 64), warps=Warps(mma=(2, 1)))
