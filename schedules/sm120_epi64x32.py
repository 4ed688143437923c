"""128x128x128 with a 64x32 epilogue tile: four mainloop stages instead of three.

The whole-tile epilogue buffer costs 32 KiB; storing the tile in 64x32 pieces through a
4-deep 16 KiB buffer frees one more 18 KiB stage for the mainloop, which helps when the
loads, not the MMAs, are the bottleneck.
"""

from cute_fp4.schedule import Epilogue, Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128), epilogue=Epilogue(tile=(64, 32)))
