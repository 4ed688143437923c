"""Hopper, one CTA per tile, FP32 output stored from registers, raster along N.

The simplest launch and the full-precision output: a baseline for the persistent
schedules and the path that returns the FP32 accumulators (times alpha) unrounded.
"""

from cute_fp4.schedule import Epilogue, OutDtype, Raster, Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 128, 128), warps=Warps(mma=(2, 1)),
                    scheduler=Scheduler(persistent=False, raster=Raster.ALONG_N),
                    epilogue=Epilogue(out_dtype=OutDtype.FP32))
