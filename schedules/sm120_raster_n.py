"""Persistent tiles rasterised along N in groups of 16.

Consecutive CTAs then share a 128-row block of A and walk across B: better L2 reuse when
M is large and N small (the default rasterises along M, which suits large N).
"""

from cute_fp4.schedule import Raster, Schedule, Scheduler, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128),
                    scheduler=Scheduler(raster=Raster.ALONG_N, group_size=16))
